"""Command line interface (placeholder until the CLI lands)."""


def main() -> None:
    print("trainsnap: the CLI is being built; use the Python API (see README.md).")
