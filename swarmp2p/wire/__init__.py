"""What crosses the network: msgpack control messages, tensor frames and codecs. No torch."""
