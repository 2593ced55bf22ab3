"""Images and audio: encoder reuse and TTFT."""
