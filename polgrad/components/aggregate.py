"""Built-in aggregate parts (see protocols.py for the call signature)."""
