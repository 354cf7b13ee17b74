"""The driver-side coordinator and client that keep weight refits consistent (DESIGN.md).

Not built yet: see the open issues.
"""
