"""Built-in kl parts (see protocols.py for the call signature)."""
