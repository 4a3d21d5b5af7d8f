"""Built-in kl_controller parts (see protocols.py for the call signature)."""
