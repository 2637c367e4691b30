"""Runnable applications built on the library (the demo, the benchmarks, the run report, the CLI's jobs).

Unlike the core modules of :mod:`hetero_plugins`, these use Lightning: they are users of the library.
"""
