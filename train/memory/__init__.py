"""Out-of-memory survival and memory probes: a rank that runs out drops or cuts a step in step with the others; imports parallel and the loader."""
