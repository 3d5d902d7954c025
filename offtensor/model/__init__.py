"""A wrapped model: its state (``state``), its tensors by storage (``groups``), the moves that place
them (``moves``), what its modules place after wrapping (``assignment``, ``place``, ``room``,
``casts``, ``loads``, ``dtensor``), copies of it (``copies``), host reads (``host``), and the one
``prepare`` pipeline that wrap_model, the loader and ``ot.plan`` run (``prepare``)."""
