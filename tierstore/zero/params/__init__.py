"""The model's parameters: partitioned placeholders, zero.Init, the shard layout, gathering for the user, tiling,
the module's state dict and the guards on the model.
"""
