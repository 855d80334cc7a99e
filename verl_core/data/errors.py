class DataError(ValueError):
    """Input data that cannot be used; the message names the row and field."""
