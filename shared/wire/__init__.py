"""Code generated from protos/splitspec.proto (``make proto``); never edit the *_pb2 files by hand."""
