"""The ZMQ replay buffer: service (`server`), its write-ahead log (`wal`), state machine (`store`),
wire protocol (`protocol`), CURVE keys (`keys`), clients (`client`), Ray actor (`actor`) and CLI (`cli`)."""
