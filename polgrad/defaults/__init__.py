"""polgrad's default configuration, shipped inside the package: base_tiny.gin (the tiny model on
task.add), which `python -m polgrad.train` parses first. A package (not a plain folder), so that gin
finds `include 'polgrad/defaults/base_tiny.gin'` through the installed package from any working
directory (gin's system-path reader resolves 'polgrad/defaults' with importlib)."""
