"""The package's version, in a module of its own so that what reports it (the daemon's
status, ``--version``) imports nothing else of the package."""

__version__ = "0.1.0"  # pyproject.toml's [project] version
