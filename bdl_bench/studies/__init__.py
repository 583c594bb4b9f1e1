"""Analyses that run on fitted methods or finished run folders (post-hoc studies and their figures);
they read ``methods``, ``data`` and results folders, never the other way round."""
