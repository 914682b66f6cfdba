"""Placeholder: the owner of this command group replaces it."""


def register(subparsers) -> None:
    pass
