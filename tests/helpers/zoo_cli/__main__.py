"""``python -m tests.helpers.zoo_cli fit --config tests/helpers/zoo_cli/config.yaml``."""

from tests.helpers.zoo_cli.project import main

__all__: list[str] = []

if __name__ == "__main__":
    main()
