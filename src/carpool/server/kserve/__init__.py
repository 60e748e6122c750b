"""The KServe v2 codec: wire bytes into a typed request, a typed result into wire bytes,
for REST (JSON and Triton's binary tensor extension) and gRPC alike::

    REST body ─► rest_decode ─┐                          ┌─► rest_encode ─► REST body
                              ├─► InferRequest ─► model ─┤
    gRPC message ─► grpc_codec┘                          └─► grpc_codec ─► gRPC message

Inputs leave as arrays with the outputs asked for and the parameters (``InferRequest``);
JSON ``data`` is read by :mod:`.json_data`, and REST answers are planned per output shape
by :mod:`.rest`.

- :mod:`.tensors`: datatypes, the typed values (``InferRequest``, ``InputTensor``,
  ``RequestedOutput``, ``OutputTensor``), BYTES elements, and raw bytes both ways (one
  reader for REST's binary data and gRPC's raw contents, one writer for both answers).
- :mod:`.requested`: the outputs a request asks for: one parser for both wires, one
  resolver against the model's declared outputs, the tensors an answer carries.
- :mod:`.rest_decode`, :mod:`.json_data`, :mod:`.rest_encode`: REST requests and answers.
- :mod:`.grpc_codec`: ``ModelInferRequest`` and ``ModelInferResponse``.
- :mod:`.rest`: a REST request from body to answer with per-header plans
  (``InferPlans``, the one cache), what the HTTP layer calls (``carpool.server.infer``).

Where a request is checked, each thing once:

- the wire format (names, datatypes, shapes, sizes, parameters): by the decoder of its
  wire, per request, or once per header for a planned REST request;
- the inputs against the model's declared inputs, and the batch dimension they share:
  ``ServedModel.payload``, per request over gRPC, once per plan over REST (the batch
  dimension by :func:`carpool.core.collate.shared_rows`, which the batcher's collator
  also counts a request's rows with);
- the priority and timeout parameters: ``ServedModel.submit_options``, again when the
  model's batch policy changed (``Batcher.policy_version``);
- the model's result against the declared outputs: once per batch, before it is split
  into requests (:func:`carpool.server.outputs.check_outputs`); the encoders trust it.

Nothing here knows sockets: the HTTP layer and the gRPC service hand it bytes and messages.
"""
