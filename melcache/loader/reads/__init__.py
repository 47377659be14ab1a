"""What a loader worker reads: whole shards, each checked against its index entry and read
through the node's local copies (``shards``), and the derived fields beside a batch's mel
shards (``fields``)."""
