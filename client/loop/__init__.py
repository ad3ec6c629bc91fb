"""The decode loop and its policy: the loop (``decode``), drafting ahead and chained rounds (``ahead``), stretches
(``stretch``), the offline stage (``offline``), and the adaptive policy (``adaptive``: ``sizing``, ``schedule``,
``costs``)."""
