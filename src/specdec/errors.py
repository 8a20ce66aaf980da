"""User-facing errors: one clear sentence naming the problem and the fix."""


class SpecdecError(ValueError):
    """Bad input or configuration. The CLI prints the message and exits with code 2, without a traceback."""


class PluginError(SpecdecError):
    """A plugin broke a contract (wrong draft shape, ids out of range, duplicate names)."""
