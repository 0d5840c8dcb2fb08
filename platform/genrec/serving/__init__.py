"""The Ray Serve adapter: an HTTP ingress in front of autoscaled AsyncEngine replicas.

Nothing else in genrec imports Serve. `deployments/*.yaml` name `genrec.serving.app:build_app` as their
`import_path`; its one argument (`AppArgs`) is validated when the config is deployed.
"""

from genrec.serving.args import AppArgs

__all__ = ["AppArgs"]
