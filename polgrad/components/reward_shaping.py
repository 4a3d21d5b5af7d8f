"""Built-in reward_shaping parts (see protocols.py for the call signature)."""
