"""Live capture: the only package that imports bcc (and, later, pynvml)."""
