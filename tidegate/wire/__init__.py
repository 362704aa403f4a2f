"""Sans-I/O, what goes on the wire: envelopes, subjects, flow control, mux,
cancels, the token estimate."""
