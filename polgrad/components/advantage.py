"""Built-in advantage parts (see protocols.py for the call signature)."""
