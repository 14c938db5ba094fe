"""Unit tests of flasync.algorithms: the plug-ins of the algorithm-state seam."""
