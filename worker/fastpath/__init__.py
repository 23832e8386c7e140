"""The fast path: Kubernetes watches and engine health probes that open incidents in seconds."""
