"""A failure decorated with torch's @record: the message must reach launch's summary."""
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    raise ValueError("interop: the loss went to NaN at step 7")


main()
