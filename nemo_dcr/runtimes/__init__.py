"""Serving runtimes the receiver updates in place, one adapter package per runtime.

The seam they implement (``RuntimeAdapter``, ``TensorSpec``) lives on the receiver's floor,
``nemo_dcr.receiver.runtime``: runtimes import the receiver, never the reverse.  Importing
this package does not import any runtime.
"""
