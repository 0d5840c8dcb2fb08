"""The demo's end-to-end run."""
