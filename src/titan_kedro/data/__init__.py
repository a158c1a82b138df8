"""C4 sources, tokenizer wrapper, packing, token store and the distributed token loader.

Library code: nothing here imports Kedro. The Kedro nodes in
``titan_kedro.pipelines.data_processing`` are thin wrappers over these modules.
"""
