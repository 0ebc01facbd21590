"""The ZeRO-3 hooks and their scheduling: gathering a module's parameters for forward and backward, fetching ahead,
reducing gradients, the events other features subscribe to.
"""
