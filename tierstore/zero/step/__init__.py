"""The step pipeline: sub-groups read, stepped and written back through bounded buffers, overlapped with backward
where exact; gradients' partitions, clipping, 8-bit states.
"""
