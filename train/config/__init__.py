"""The run's config: the [model] [data] [optim] [train] tables, read and checked; imports only melcache."""
