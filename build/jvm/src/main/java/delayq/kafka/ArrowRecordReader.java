package delayq.kafka;

import java.io.FileOutputStream;
import java.io.IOException;
import java.io.OutputStream;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;

import org.apache.arrow.memory.BufferAllocator;
import org.apache.arrow.memory.RootAllocator;
import org.apache.arrow.vector.BigIntVector;
import org.apache.arrow.vector.FieldVector;
import org.apache.arrow.vector.IntVector;
import org.apache.arrow.vector.TimeStampMicroTZVector;
import org.apache.arrow.vector.VarBinaryVector;
import org.apache.arrow.vector.VarCharVector;
import org.apache.arrow.vector.VectorSchemaRoot;
import org.apache.arrow.vector.complex.ListVector;
import org.apache.arrow.vector.complex.StructVector;
import org.apache.arrow.vector.ipc.ArrowStreamWriter;
import org.apache.arrow.vector.types.TimeUnit;
import org.apache.arrow.vector.types.pojo.ArrowType;
import org.apache.arrow.vector.types.pojo.FieldType;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.ConsumerRecords;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * Reads Kafka records into Arrow from the driver's JVM, for the ingest job
 * (engine/produce/kafka_ingest.py): the counterpart of {@link ArrowRecordSender}.
 *
 * <p>A plain {@link KafkaConsumer} with partitions assigned by the caller (no consumer group,
 * no offsets committed to Kafka): the caller records where it is in the Delta commit that
 * stores the records, and seeks there when it starts. {@link #poll} writes what it read as an
 * Arrow IPC stream to a file, with the columns of Spark's Kafka source ({@code key, value,
 * topic, partition, offset, timestamp, headers}), so the records cross to Python in one piece
 * instead of through a Spark job. One thread at a time (a KafkaConsumer is not thread-safe).
 */
public final class ArrowRecordReader implements AutoCloseable {
  private static final BufferAllocator ALLOCATOR = new RootAllocator();
  private static final long EARLIEST = -2L;
  private static final long LATEST = -1L;

  private final KafkaConsumer<byte[], byte[]> consumer;
  private final Set<TopicPartition> assigned = new LinkedHashSet<>();

  /** A reader with these consumer settings (bootstrap.servers, isolation.level, ...). */
  public ArrowRecordReader(Map<String, String> settings) {
    Map<String, Object> config = new HashMap<>(settings);
    config.put("key.deserializer", ByteArrayDeserializer.class.getName());
    config.put("value.deserializer", ByteArrayDeserializer.class.getName());
    config.put("enable.auto.commit", "false");
    config.remove("group.id");
    this.consumer = new KafkaConsumer<>(config);
  }

  /** The partitions of {@code topic}, sorted (empty: no such topic yet). */
  public List<Integer> partitions(String topic, int timeoutMs) {
    List<PartitionInfo> infos = consumer.partitionsFor(topic, Duration.ofMillis(timeoutMs));
    List<Integer> found = new ArrayList<>();
    if (infos != null) {
      for (PartitionInfo info : infos) {
        found.add(info.partition());
      }
    }
    found.sort(null);
    return found;
  }

  /**
   * Read {@code topic}'s {@code partition} from now on, from {@code offset} (-2: the earliest
   * offset Kafka has, -1: the end). The offset is text: the Python-JVM bridge passes small
   * numbers as {@code Integer}, which it does not widen to {@code long}.
   */
  public void seek(String topic, int partition, String at) {
    long offset = Long.parseLong(at);
    TopicPartition part = new TopicPartition(topic, partition);
    if (assigned.add(part)) {
      consumer.assign(new ArrayList<>(assigned));
    }
    if (offset == EARLIEST) {
      consumer.seekToBeginning(List.of(part));
    } else if (offset == LATEST) {
      consumer.seekToEnd(List.of(part));
    } else {
      consumer.seek(part, offset);
    }
  }

  /** The next offset this reader reads of a partition it reads. */
  public long position(String topic, int partition) {
    return consumer.position(new TopicPartition(topic, partition));
  }

  /** The end offset of each partition this reader reads, as {@code topic:partition -> end}. */
  public Map<String, Long> endOffsets() {
    Map<String, Long> ends = new HashMap<>();
    for (Map.Entry<TopicPartition, Long> end : consumer.endOffsets(assigned).entrySet()) {
      ends.put(end.getKey().topic() + ":" + end.getKey().partition(), end.getValue());
    }
    return ends;
  }

  /**
   * Read up to {@code maxRecords} records and write them to {@code path} as an Arrow IPC stream
   * of one batch: wait up to {@code timeoutMs} for the first, then read on for up to {@code
   * lingerMs} more while records keep coming (fewer, larger batches under load).
   *
   * @return how many records were written (0: none came within the timeout; the file is then
   *     an empty stream)
   */
  public int poll(int timeoutMs, int lingerMs, int maxRecords, String path) throws IOException {
    List<ConsumerRecord<byte[], byte[]>> taken = new ArrayList<>();
    ConsumerRecords<byte[], byte[]> got = consumer.poll(Duration.ofMillis(timeoutMs));
    long until = System.nanoTime() + lingerMs * 1_000_000L;
    while (!got.isEmpty()) {
      for (ConsumerRecord<byte[], byte[]> record : got) {
        taken.add(record);
      }
      long left = until - System.nanoTime();
      if (taken.size() >= maxRecords || left <= 0) {
        break;
      }
      got = consumer.poll(Duration.ofNanos(left));
    }
    // The consumer may have read past maxRecords: read them again next time.
    if (taken.size() > maxRecords) {
      Map<TopicPartition, Long> back = new HashMap<>();
      for (ConsumerRecord<byte[], byte[]> record : taken.subList(maxRecords, taken.size())) {
        back.putIfAbsent(new TopicPartition(record.topic(), record.partition()), record.offset());
      }
      back.forEach(consumer::seek);
      taken = taken.subList(0, maxRecords);
    }
    write(taken, path);
    return taken.size();
  }

  @Override
  public void close() {
    consumer.close(Duration.ofSeconds(5));
  }

  private static void write(List<ConsumerRecord<byte[], byte[]>> records, String path)
      throws IOException {
    int rows = records.size();
    try (BufferAllocator allocator = ALLOCATOR.newChildAllocator("read", 0, Long.MAX_VALUE);
        VarBinaryVector keys = new VarBinaryVector("key", allocator);
        VarBinaryVector values = new VarBinaryVector("value", allocator);
        VarCharVector topics = new VarCharVector("topic", allocator);
        IntVector partitions = new IntVector("partition", allocator);
        BigIntVector offsets = new BigIntVector("offset", allocator);
        TimeStampMicroTZVector stamps =
            new TimeStampMicroTZVector(
                "timestamp",
                FieldType.nullable(new ArrowType.Timestamp(TimeUnit.MICROSECOND, "UTC")),
                allocator);
        ListVector headers = ListVector.empty("headers", allocator)) {
      StructVector entries =
          (StructVector)
              headers
                  .addOrGetVector(FieldType.nullable(ArrowType.Struct.INSTANCE))
                  .getVector();
      VarCharVector names =
          entries.addOrGet("key", FieldType.nullable(ArrowType.Utf8.INSTANCE), VarCharVector.class);
      VarBinaryVector contents =
          entries.addOrGet(
              "value", FieldType.nullable(ArrowType.Binary.INSTANCE), VarBinaryVector.class);
      keys.allocateNew(rows);
      values.allocateNew(rows);
      topics.allocateNew(rows);
      partitions.allocateNew(rows);
      offsets.allocateNew(rows);
      stamps.allocateNew(rows);
      headers.allocateNew();
      int entry = 0;
      byte[] lastTopic = null;
      String lastTopicName = null;
      for (int i = 0; i < rows; i++) {
        ConsumerRecord<byte[], byte[]> record = records.get(i);
        if (record.key() == null) {
          keys.setNull(i);
        } else {
          keys.setSafe(i, record.key());
        }
        if (record.value() == null) {
          values.setNull(i);
        } else {
          values.setSafe(i, record.value());
        }
        if (!record.topic().equals(lastTopicName)) {
          lastTopicName = record.topic();
          lastTopic = lastTopicName.getBytes(StandardCharsets.UTF_8);
        }
        topics.setSafe(i, lastTopic);
        partitions.setSafe(i, record.partition());
        offsets.setSafe(i, record.offset());
        stamps.setSafe(i, record.timestamp() * 1000L);
        headers.startNewValue(i);
        int count = 0;
        for (Header header : record.headers()) {
          entries.setIndexDefined(entry);
          names.setSafe(entry, header.key().getBytes(StandardCharsets.UTF_8));
          if (header.value() == null) {
            contents.setNull(entry);
          } else {
            contents.setSafe(entry, header.value());
          }
          entry++;
          count++;
        }
        headers.endValue(i, count);
      }
      names.setValueCount(entry);
      contents.setValueCount(entry);
      entries.setValueCount(entry);
      headers.setValueCount(rows);
      List<FieldVector> vectors =
          List.of(keys, values, topics, partitions, offsets, stamps, headers);
      for (FieldVector vector : vectors) {
        if (vector != headers) {
          vector.setValueCount(rows);
        }
      }
      try (VectorSchemaRoot root = new VectorSchemaRoot(vectors);
          OutputStream out = new FileOutputStream(path);
          ArrowStreamWriter writer = new ArrowStreamWriter(root, null, out)) {
        writer.start();
        writer.writeBatch();
        writer.end();
      }
    }
  }
}
