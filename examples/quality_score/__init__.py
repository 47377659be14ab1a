"""A quality score derived beside the mels, to filter or weigh by at load time (#53)."""
