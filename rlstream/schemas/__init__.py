"""Wire contract of rlstream: Avro schemas, typed models, the codec, topics and configuration."""
