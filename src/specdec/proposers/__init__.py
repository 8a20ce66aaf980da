"""Built-in proposers, registered through the same hook as third-party ones (see specdec.builtin)."""
