"""Offloaded inference: forward and generate with the weights on the host or nvme tier, without an optimizer.
"""
