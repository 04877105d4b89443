"""The foundation: exceptions, sample fields, plain-data state helpers, rank and worker.

Imports nothing else of wdsraft; every other layer may import it.
"""
