"""The agent loop (``loop``) and its context budget (``context``): no process of their own, no I/O.

Here, below ``magnitude/``, so that the gateway can drive the same loop over HTTP that ``magnitude.agent``
drives in process.
"""
