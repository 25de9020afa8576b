"""What the tests share: the models (:mod:`.models`), the data (:mod:`.data`), the multi-rank scenarios as
typed records (:mod:`.scenarios`), the comparisons (:mod:`.compare`) and the worker side of a launch
(:mod:`.worker`)."""
