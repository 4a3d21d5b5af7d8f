"""Built-in filter parts (see protocols.py for the call signature)."""
