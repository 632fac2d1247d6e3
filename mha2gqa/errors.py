"""The one exception type for user mistakes.

Anything raised as InputError is the user's to fix: the CLI prints its message as a single line
and exits with code 2. Its message names the value, the rule and the fix.
"""


class InputError(ValueError):
    """Bad input from the user (a flag, a path, a recipe key); never a bug in mha2gqa."""
