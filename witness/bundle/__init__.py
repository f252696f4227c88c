"""The bundle: a versioned on-disk format of JSON, JSON lines and safetensors, never pickles."""
