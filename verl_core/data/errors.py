from verl_core.errors import UserError


class DataError(UserError, ValueError):
    """Input data that cannot be used; the message names the row and field."""
