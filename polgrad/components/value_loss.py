"""Built-in value_loss parts (see protocols.py for the call signature)."""
