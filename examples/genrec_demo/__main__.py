"""`python -m genrec_demo`: see genrec_demo.cli."""

from genrec_demo.cli import main

if __name__ == "__main__":
    main()
