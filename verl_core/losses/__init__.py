"""Pure loss and advantage functions on tensors: no models, no state.

Each family lives in its own module; registries map config strings to functions.
"""
