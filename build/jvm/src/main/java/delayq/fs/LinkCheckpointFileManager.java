package delayq.fs;

import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.nio.file.FileAlreadyExistsException;
import java.nio.file.Files;
import java.util.UUID;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.Path;
import org.apache.spark.sql.execution.streaming.checkpointing.CheckpointFileManager;
import org.apache.spark.sql.execution.streaming.checkpointing.FileContextBasedCheckpointFileManager;

/**
 * A Structured Streaming checkpoint file manager for file: paths whose new files (a batch's
 * entry in the offsets and commit logs) are created put-if-absent with a hard link, as
 * {@link LinkLogStore} creates Delta commits; anything else (other schemes, files that may be
 * replaced) is Spark's default, {@link FileContextBasedCheckpointFileManager}.
 *
 * <p>The content is written to a hidden temporary file beside the target and flushed to the
 * device, then linked to the target's name: the link fails if the name exists, so a second
 * writer of one batch gets {@link org.apache.hadoop.fs.FileAlreadyExistsException}, which Spark
 * reports as another query using the checkpoint. Spark's default renames with Hadoop's
 * FileContext instead, and its checksum file system writes a {@code .crc} file beside each entry:
 * about 50 ms an entry on the machine this was measured on, two entries a micro-batch.
 *
 * <p>Enable for a session: {@code spark.sql.streaming.checkpointFileManagerClass=
 * delayq.fs.LinkCheckpointFileManager} (delayq sets it on its stages' own queries only).
 */
public class LinkCheckpointFileManager extends FileContextBasedCheckpointFileManager {
  private final boolean local;

  public LinkCheckpointFileManager(Path path, Configuration hadoopConf) {
    super(path, hadoopConf);
    String scheme = path.toUri().getScheme();
    this.local = scheme == null || "file".equals(scheme);
  }

  @Override
  public CheckpointFileManager.CancellableFSDataOutputStream createAtomic(
      Path path, boolean overwriteIfPossible) {
    if (!local || overwriteIfPossible) {
      return super.createAtomic(path, overwriteIfPossible);
    }
    File target = new File(path.toUri().getPath());
    File temp = new File(target.getParentFile(), "." + target.getName() + "." + UUID.randomUUID() + ".tmp");
    FileOutputStream out;
    try {
      target.getParentFile().mkdirs();
      out = new FileOutputStream(temp);
    } catch (IOException e) {
      throw new RuntimeException("cannot create " + temp, e);
    }
    return new LinkedOnClose(out, temp, target, path);
  }

  /** Writes the temporary file; on close, flushes it and links it to the target's name. */
  private static final class LinkedOnClose extends CheckpointFileManager.CancellableFSDataOutputStream {
    private final FileOutputStream file;
    private final File temp;
    private final File target;
    private final Path path;
    private boolean done;

    LinkedOnClose(FileOutputStream file, File temp, File target, Path path) {
      super(file);
      this.file = file;
      this.temp = temp;
      this.target = target;
      this.path = path;
    }

    @Override
    public synchronized void close() throws IOException {
      if (done) {
        return;
      }
      done = true;
      try {
        flush();
        file.getFD().sync();
        super.close();
        Files.createLink(target.toPath(), temp.toPath());
      } catch (FileAlreadyExistsException e) {
        throw new org.apache.hadoop.fs.FileAlreadyExistsException(path + " already exists");
      } finally {
        Files.deleteIfExists(temp.toPath());
      }
    }

    @Override
    public synchronized void cancel() {
      if (done) {
        return;
      }
      done = true;
      try {
        super.close();
      } catch (IOException ignored) {
        // being cancelled: the temporary file goes either way
      }
      try {
        Files.deleteIfExists(temp.toPath());
      } catch (IOException ignored) {
        // a hidden temporary file left behind is ignored by Spark's listings
      }
    }
  }
}
