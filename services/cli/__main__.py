"""`python -m services.cli`: the `supportmatrix` command without its entry point."""

from services.cli.app import main

if __name__ == "__main__":
    main()
