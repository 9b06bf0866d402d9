"""Graph IR: loading, the read-only planning view, rewriting and export."""
