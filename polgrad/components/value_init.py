"""Built-in value_init parts (see protocols.py for the call signature)."""
