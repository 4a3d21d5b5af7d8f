"""Built-in clip parts (see protocols.py for the call signature)."""
