"""Readers and writers: bytes and headers only, nothing about quantization."""
